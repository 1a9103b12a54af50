from django.urls import path

from tasks_app.api import profiles as p
from tasks_app.api import progress as g
from tasks_app.api import views as v

urlpatterns = [
    path("tasks/", v.TaskListCreate.as_view()),
    path("tasks/<uuid:task_id>/", v.TaskDetail.as_view()),
    path("tasks/<uuid:task_id>/cancel/", v.TaskCancel.as_view()),
    path("tasks/<uuid:task_id>/entries/", g.TaskEntries.as_view()),
    path("tasks/<uuid:task_id>/integrate/", v.TaskIntegrate.as_view()),
    path("tasks/<uuid:task_id>/messages/", v.TaskMessages.as_view()),
    path("tasks/<uuid:task_id>/messages/<int:seq>/withdraw/", v.TaskMessageWithdraw.as_view()),
    path("tasks/<uuid:task_id>/interrupt/", v.TaskInterrupt.as_view()),
    path("tasks/<uuid:task_id>/end/", v.TaskEnd.as_view()),
    path("budget/", v.BudgetView.as_view()),
    path("token/rotate/", v.OwnerTokenRotate.as_view()),
    path("machines/", v.MachineList.as_view()),
    path("machines/pairing-codes/", v.PairingCodeCreate.as_view()),
    path("machines/<uuid:machine_id>/unpair/", v.MachineUnpair.as_view()),
    path("pools/", v.PoolListCreate.as_view()),
    path("pools/<uuid:pool_id>/", v.PoolDetail.as_view()),
    path("grants/", v.GrantListCreate.as_view()),
    path("grants/<uuid:grant_id>/revoke/", v.GrantRevoke.as_view()),
    path("worker/pair/", v.WorkerPair.as_view()),
    path("worker/messages/", v.WorkerMessages.as_view()),
    path("worker/messages/<uuid:message_id>/ack/", v.WorkerMessageAck.as_view()),
    path("worker/leases/", v.WorkerLeaseGrant.as_view()),
    path("worker/leases/<uuid:lease_id>/renew/", v.WorkerLeaseRenew.as_view()),
    path("worker/receipts/", v.WorkerReceipts.as_view()),
    path("worker/sync/", v.WorkerSync.as_view()),
    path("worker/profiles/", p.WorkerProfiles.as_view()),
    path("worker/progress/", g.WorkerProgress.as_view()),
]
