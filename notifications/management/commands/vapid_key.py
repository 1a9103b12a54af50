"""``manage.py vapid_key``: print the deployment's VAPID public key (base64url), creating
the key pair on first use (N2). The private key stays in the database."""
from django.core.management.base import BaseCommand

from notifications.services import vapid_key


class Command(BaseCommand):
    help = "Print the VAPID public key for Web Push, creating the key pair once per deployment."

    def handle(self, *args, **options):
        self.stdout.write(vapid_key().public_key)
