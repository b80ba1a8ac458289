from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),  # the admin is the operator's console
    path("durable/", include("durable_agents.urls")),  # the signed links approval requests carry
]
