"""OpenAPI (drf-spectacular) description of the machine token scheme."""
from drf_spectacular.extensions import OpenApiAuthenticationExtension


class MachineAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "tasks_app.auth.MachineAuthentication"
    name = "machineToken"

    def get_security_definition(self, auto_schema):
        return {"type": "apiKey", "in": "header", "name": "Authorization", "description": "Machine <token>"}
