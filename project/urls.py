"""URL routes: the admin is the operator console."""

from django.contrib import admin
from django.urls import include, path

from durable_agents.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("durable/", include("durable_agents.urls")),
    # Prometheus: a bearer token (DURABLE_AGENTS["METRICS_TOKEN"]) or a staff login; see durable_agents/metrics.py.
    path("metrics", metrics_view, name="durable_metrics"),
]
