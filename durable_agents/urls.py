"""URLs of the app: the decision page of signed approval links. Include under any prefix."""

from django.urls import path

from durable_agents import views

app_name = "durable_agents"

urlpatterns = [
    path("waits/<int:wait_id>/decide/<str:token>/", views.decide_wait, name="decide_wait"),
]
