from django.urls import path

from tests.django_project import views

urlpatterns = [
    path("healthz", views.healthz),
    path("q/<str:queue>/tasks", views.submit),
    path("q/<str:queue>/tasks/<str:task_id>/events", views.events),
    path("qc/<str:queue>/tasks/<str:task_id>/events", views.events_cancel),
    path("q/<str:queue>/orders", views.order),
    path("aq/<str:queue>/tasks", views.asubmit),
    path("aq/<str:queue>/tasks/<str:task_id>/events", views.aevents),
    path("aqc/<str:queue>/tasks/<str:task_id>/events", views.aevents_cancel),
]
