"""Notifications (SPEC N1-N3): per-owner settings, an outbox of notification events
written in the transaction that caused them, and their delivery after commit to the open
board, Web Push subscriptions and a webhook.

It sits on top of ``tasks_app`` and ``sessions_app`` (a Django app of its own, label
``notifications``); nothing below imports it except through the emit functions in
``services``.
"""
