"""Q6: the notification kind ``approval``, on by default: the kind's choice, and every
stored settings row gets ``kinds["approval"] = True`` (a row without it reads as on
anyway: ``NotificationSettings.kind_on``)."""
from django.db import migrations, models


def approval_on(apps, schema_editor):
    NotificationSettings = apps.get_model("notifications", "NotificationSettings")
    for row in NotificationSettings.objects.all():
        if "approval" not in row.kinds:
            row.kinds = {**row.kinds, "approval": True}
            row.save(update_fields=["kinds"])


class Migration(migrations.Migration):

    dependencies = [
        ('notifications', '0001_initial'),
    ]

    operations = [
        migrations.AlterField(
            model_name='notification',
            name='kind',
            field=models.CharField(choices=[('session_idle', 'Session Idle'), ('attention', 'Attention'), ('unknown', 'Unknown'), ('task_succeeded', 'Task Succeeded'), ('task_failed', 'Task Failed'), ('approval', 'Approval')], max_length=30),
        ),
        migrations.RunPython(approval_on, migrations.RunPython.noop),
    ]
