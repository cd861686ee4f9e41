"""Settings of the test project, from environment variables:

* ``MTQ_DJANGO_REDIS_URL``: ``MTQ["REDIS_URL"]`` (unset: the ``MTQ_REDIS_URL``
  variable is used, as in any project without the key);
* ``MTQ_QUEUE``: ``MTQ["QUEUE"]``; ``MTQ_DJANGO_WORKERS``: ``MTQ["WORKERS"]``;
  ``MTQ_WEB_KEEPALIVE``: ``MTQ["KEEPALIVE_S"]``;
* ``MTQ_DJANGO_RQ_URL`` and ``MTQ_DJANGO_RQ_QUEUE``: django-rq installed, with that
  one queue (RQ's JSON serializer), for ``mtq rq worker`` to serve;
* ``MTQ_DJANGO_DB``: the SQLite file (``python tests/django_project/manage.py
  migrate --run-syncdb`` makes its table); ``:memory:`` when unset.
"""

import os

SECRET_KEY = "test only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "tests.django_project.urls"
INSTALLED_APPS = ["mtq.contrib.django", "tests.django_project"]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "tests.django_project.middleware.HeaderUserMiddleware",
    "mtq.contrib.django.middleware.MtqErrorMiddleware",
]
# sessions in a signed cookie: no session table (the session's stream id lives there)
SESSION_ENGINE = "django.contrib.sessions.backends.signed_cookies"
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3",
                         "NAME": os.environ.get("MTQ_DJANGO_DB", ":memory:")}}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
USE_TZ = True

MTQ = {"QUEUE": os.environ.get("MTQ_QUEUE", "default"),
       "KEEPALIVE_S": float(os.environ.get("MTQ_WEB_KEEPALIVE", "15"))}
if os.environ.get("MTQ_DJANGO_REDIS_URL"):
    MTQ["REDIS_URL"] = os.environ["MTQ_DJANGO_REDIS_URL"]
if os.environ.get("MTQ_DJANGO_WORKERS"):
    MTQ["WORKERS"] = os.environ["MTQ_DJANGO_WORKERS"]
if os.environ.get("MTQ_DJANGO_RQ_URL"):
    INSTALLED_APPS.append("django_rq")
    RQ_QUEUES = {os.environ["MTQ_DJANGO_RQ_QUEUE"]: {
        "URL": os.environ["MTQ_DJANGO_RQ_URL"],
        "SERIALIZER": "rq.serializers.JSONSerializer"}}
