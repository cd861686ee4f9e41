"""The Django project the web tests serve (tests/integration/test_web_django.py):
settings from environment variables (settings.py), sync and async views (views.py),
under a real gunicorn (wsgi.py) and a real uvicorn (asgi.py)."""
