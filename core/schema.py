"""OpenAPI helpers shared by the apps (H): the schema of every wire shape generated from its
one ``TypedDict`` (``shape``), the one error shape and the error responses every operation
declares, so a client generated from ``/api/schema/`` can read answers and refusals."""
import functools
import typing
from enum import Enum
from types import UnionType
from typing import Annotated, Any, Literal, NotRequired, Required, Union, get_args, get_origin, get_type_hints

from django.http import HttpResponse
from drf_spectacular.plumbing import ResolvedComponent, build_mocked_view
from drf_spectacular.settings import spectacular_settings
from drf_spectacular.utils import OpenApiResponse, PolymorphicProxySerializer, extend_schema, extend_schema_view
from drf_spectacular.views import SpectacularAPIView
from rest_framework import serializers
from rest_framework.renderers import JSONRenderer

from core.errors import ErrorShape
from core.wire import Doc, Format

_STRING_FORMATS = {"uuid": serializers.UUIDField, "date-time": serializers.DateTimeField, "uri": serializers.URLField}
_PLAIN = {str: serializers.CharField, int: serializers.IntegerField, float: serializers.FloatField, bool: serializers.BooleanField}


def shape(typed_dict: type, *, many: bool = False) -> serializers.Serializer:
    """What ``extend_schema(responses=...)`` takes for a wire shape: a serializer that
    describes ``typed_dict`` (a ``TypedDict`` of a ``shapes`` module, written with
    ``core.wire``), ``many=True`` for a list (paginated by the view's paginator). Its
    component is named after the ``TypedDict`` and described by its docstring. Only
    describes: answers are rendered by the shape's builder, never by this serializer."""
    return shape_serializer(typed_dict)(many=many)


@functools.cache
def shape_serializer(typed_dict: type) -> type[serializers.Serializer]:
    """The serializer class of ``typed_dict``, one per ``TypedDict`` (so drf-spectacular
    makes one component of it). Raises TypeError on a field type ``core.wire`` does not
    describe, when the schema is generated (at the latest in ``tests/test_api_schema.py``)."""
    if not typing.is_typeddict(typed_dict):
        raise TypeError(f"{typed_dict!r} is not a TypedDict")
    hints = get_type_hints(typed_dict, include_extras=True)
    fields = {
        name: _field(hint, required=name in typed_dict.__required_keys__, where=f"{typed_dict.__name__}.{name}")
        for name, hint in hints.items()
    }
    return type(typed_dict.__name__, (serializers.Serializer,), {
        "__module__": typed_dict.__module__, "__doc__": typed_dict.__doc__, **fields,
    })


def add_components(result: dict, generator, typed_dicts, *, union: str | None = None) -> dict:
    """For a drf-spectacular postprocessing hook: adds to the generated document
    ``result`` the components of ``typed_dicts``, shapes no operation answers with (board
    events), through the same ``shape_serializer`` as the operations (so a nested shape is
    the same ``$ref``). With ``union``, also a component of that name: ``oneOf`` the
    shapes, discriminated by their ``type`` (each shape's ``Literal`` value). Returns
    ``result``."""
    view = build_mocked_view("get", "/", extend_schema(), generator.registry)
    refs = {td: view.schema.resolve_serializer(shape(td), "response").ref for td in typed_dicts}
    if union:
        mapping = {get_args(get_type_hints(td)["type"])[0]: ref["$ref"] for td, ref in refs.items()}
        schema = {"oneOf": list(refs.values()), "discriminator": {"propertyName": "type", "mapping": mapping}}
        generator.registry.register_on_missing(
            ResolvedComponent(name=union, type=ResolvedComponent.SCHEMA, schema=schema, object=union)
        )
    result["components"] = generator.registry.build(spectacular_settings.APPEND_COMPONENTS)
    return result


def closed_union_members(result, generator, request, public):
    """drf-spectacular postprocessing hook (``SPECTACULAR_SETTINGS``): every component in a
    ``oneOf`` without a discriminator (a message's payload, told apart by ``kind`` beside
    it, H) gets ``additionalProperties: false``. Those shapes are the protocol's, checked
    field by field on both sides (``machine.protocol.shapes``), and only closed shapes make
    ``oneOf`` exact: an open ``CancelPayload`` (just ``operation_id``) would also match
    every ``start`` payload."""
    schemas = result.get("components", {}).get("schemas", {})
    for schema in list(schemas.values()):
        if "oneOf" in schema and "discriminator" not in schema:
            for ref in schema["oneOf"]:
                name = ref.get("$ref", "").rpartition("/")[2]
                if name in schemas:
                    schemas[name]["additionalProperties"] = False
    return result


def _field(hint, *, required: bool, where: str) -> serializers.Field:
    """The DRF field that describes one ``TypedDict`` key typed ``hint`` (``core.wire``)."""
    options: dict[str, Any] = {} if required else {"required": False}
    formats: list[str] = []
    while True:  # peel Annotated, NotRequired and Optional, in any nesting
        origin = get_origin(hint)
        if origin is Annotated:
            hint, *extras = get_args(hint)
            for extra in extras:
                if isinstance(extra, Doc):
                    options["help_text"] = str(extra)
                elif isinstance(extra, Format):
                    formats.append(str(extra))
        elif origin in (NotRequired, Required):
            hint = get_args(hint)[0]
        elif origin in (Union, UnionType) and type(None) in get_args(hint):
            rest = [arg for arg in get_args(hint) if arg is not type(None)]
            if len(rest) != 1:
                raise TypeError(f"{where}: only one type besides None is described")
            options["allow_null"] = True
            hint = rest[0]
        else:
            break
    origin = get_origin(hint)
    if typing.is_typeddict(hint):
        return shape_serializer(hint)(**options)
    if origin in (Union, UnionType) and all(typing.is_typeddict(arg) for arg in get_args(hint)):
        # One of several shapes (a message's payload, told apart by a field beside it):
        # ``oneOf``, named after the field ("MessageShape.payload" -> "MessageShapePayload").
        return PolymorphicProxySerializer(
            component_name="".join(part[:1].upper() + part[1:] for part in where.replace("_", ".").split(".")),
            serializers=[shape_serializer(arg) for arg in get_args(hint)], resource_type_field_name=None, **options)
    if origin is list:
        (item,) = get_args(hint)
        if typing.is_typeddict(item):
            return shape_serializer(item)(many=True, **options)
        return serializers.ListField(child=_field(item, required=True, where=f"{where}[]"), **options)
    if origin is dict or hint is dict:
        return serializers.DictField(**options)
    if origin is Literal:
        return serializers.ChoiceField(choices=list(get_args(hint)), **options)
    if isinstance(hint, type) and issubclass(hint, Enum) and hasattr(hint, "choices"):
        return serializers.ChoiceField(choices=hint.choices, **options)
    if hint is str and formats:
        return _STRING_FORMATS[formats[-1]](**options)
    if hint in _PLAIN:
        return _PLAIN[hint](**options)
    raise TypeError(f"{where}: {hint!r} is not a wire type (see core.wire)")


_ERROR_TEXT = {
    400: "bad input (invalid, malformed_json, invalid_cursor, ...)",
    401: "not authenticated, or a revoked token (token_revoked)",
    403: "authenticated but not allowed (permission_denied, machine_forbidden, ...)",
    404: "not found, or not the caller's (not_found)",
    405: "method not allowed",
    409: "conflict with the current state",
    413: "body too large",
    415: "not JSON",
    422: "idempotency key reused with another body",
    429: "too many requests (rate_limited, too_many_attempts); Retry-After says when to retry, in seconds",
}

# 413: any request body over DATA_UPLOAD_MAX_MEMORY_SIZE, refused before parsing (K3;
# found undocumented on POST /api/worker/progress/ by the schemathesis run).
COMMON_ERRORS = (400, 401, 403, 404, 405, 413, 415)


def errors(*extra: int) -> dict:
    """``responses`` entries for the common refusals plus ``extra`` statuses, all with
    ``ErrorShape``. Use as ``responses={200: shape(XShape), **errors(409)}``."""
    return {
        code: OpenApiResponse(shape(ErrorShape), description=_ERROR_TEXT.get(code, "refused"))
        for code in (*COMMON_ERRORS, *extra)
    }


@extend_schema_view(get=extend_schema(exclude=True))
class SchemaView(SpectacularAPIView):
    """``GET /api/schema/``: the OpenAPI document, which leaves itself out. Public, and
    no credential is read: a stale token gets the document, not a 401 (K2 matrix)."""

    authentication_classes = []
    # The rendered document by (media type, version, lang): code and settings decide it,
    # not the caller, so each process generates and renders it once (about a second each
    # time: the isolation matrix asks for it 20 times per pass).
    _rendered: dict[tuple, tuple[bytes, str, str]] = {}

    def get(self, request, *args, **kwargs):
        """The document in the negotiated media type (YAML by default, JSON with
        ``?format=json``), with its ``Content-Disposition``; from this process's cache
        after its first request."""
        key = (request.accepted_media_type, request.version, request.GET.get("version"), request.GET.get("lang"))
        if key not in self._rendered:
            response = super().get(request, *args, **kwargs)
            response.accepted_renderer = request.accepted_renderer
            response.accepted_media_type = request.accepted_media_type
            response.renderer_context = self.get_renderer_context()
            response.render()
            self._rendered[key] = (response.content, response["Content-Type"], response["Content-Disposition"])
        content, content_type, disposition = self._rendered[key]
        return HttpResponse(content, content_type=content_type, headers={"Content-Disposition": disposition})

    def handle_exception(self, exc):
        """Refusals under ``/api/`` are JSON ``{"error", "detail"}`` (H), not a YAML body in
        the document's media type."""
        response = super().handle_exception(exc)
        self.request.accepted_renderer, self.request.accepted_media_type = JSONRenderer(), "application/json"
        return response
