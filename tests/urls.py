"""URL routes of the test suite: the admin, the app's signed decision links and the metrics endpoint."""

from django.contrib import admin
from django.urls import include, path

from durable_agents.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("durable/", include("durable_agents.urls")),
    path("metrics", metrics_view, name="durable_metrics"),
]
