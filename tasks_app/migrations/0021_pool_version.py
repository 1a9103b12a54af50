from django.db import migrations, models


class Migration(migrations.Migration):
    """Issue 44: a pool's ``version`` (B2), for its ``pool`` and ``pool.deleted`` board events."""

    dependencies = [
        ('tasks_app', '0020_unknown_ask_owner'),
    ]

    operations = [
        migrations.AddField(
            model_name='pool',
            name='version',
            field=models.PositiveBigIntegerField(default=1),
        ),
    ]
