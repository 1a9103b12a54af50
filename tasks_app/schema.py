"""OpenAPI (drf-spectacular) description of the machine token and task credential schemes."""
from drf_spectacular.extensions import OpenApiAuthenticationExtension


class MachineAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "tasks_app.auth.MachineAuthentication"
    name = "machineToken"

    def get_security_definition(self, auto_schema):
        return {"type": "apiKey", "in": "header", "name": "Authorization", "description": "Machine <token>"}


class TaskCredentialScheme(OpenApiAuthenticationExtension):
    target_class = "tasks_app.auth.TaskCredentialAuthentication"
    name = "taskCredential"

    def get_security_definition(self, auto_schema):
        return {"type": "apiKey", "in": "header", "name": "Authorization",
                "description": "Task <credential>: a task's approval credential (Q5), approvals of that task only"}
