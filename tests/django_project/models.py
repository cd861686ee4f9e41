from django.db import models


class Order(models.Model):
    """A row a view writes in a transaction, and a task reads (submit_on_commit)."""

    item = models.CharField(max_length=100)

    class Meta:
        db_table = "mtq_test_order"
