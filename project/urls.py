"""URL routes: the admin is the operator console."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("durable/", include("durable_agents.urls")),
]
