"""One input rule for every API (K3): strict serializers for JSON bodies and query strings.

Both apps validate every body and every query string through this module:

- ``StrictSerializer`` (JSON bodies): a field it does not declare is refused ("unknown
  field"), and a value of the wrong JSON type is refused instead of coerced (DRF would turn
  ``5`` into ``"5"``, ``"yes"`` into ``True`` and ``"3"`` into ``3``).
- ``StrictQuerySerializer`` (query strings): an unknown parameter or a repeated one is
  refused; values are strings, so the strict fields below parse them by exact syntax
  (``QueryIntegerField`` takes ``12``, never ``12.0``, `` 12`` or ``1e1``;
  ``QueryFloatField`` a plain decimal).
- ``valid_body`` / ``valid_query`` run one of them on a request and return the validated
  data, raising DRF's ``ValidationError``, which ``core.exception_handler.exception_handler`` turns
  into 400 ``{"error": "invalid", "detail": "<field>: <problem>", "fields": {...}}``.
"""
import re

from rest_framework import serializers

from core.text import control_character

# JSON types each field kind accepts as sent, most specific kind first (a RegexField is a
# CharField, a MultipleChoiceField a ChoiceField).
_JSON_TYPES = [
    (serializers.BooleanField, (bool,)),
    (serializers.IntegerField, (int,)),
    (serializers.FloatField, (int, float)),
    (serializers.DecimalField, (int, float)),
    (serializers.DictField, (dict,)),
    (serializers.ListField, (list,)),
    (serializers.MultipleChoiceField, (list,)),
    (serializers.ListSerializer, (list,)),
    (serializers.CharField, (str,)),  # RegexField, EmailField, URLField too
    (serializers.UUIDField, (str,)),
    (serializers.ChoiceField, (str,)),
    (serializers.DateTimeField, (str,)),
    (serializers.Serializer, (dict,)),
]


def json_type_problem(field: serializers.Field, value) -> str | None:
    """Why ``value`` (parsed JSON) is not of the JSON type ``field`` takes, or None. A
    boolean is never a number (Python's ``True == 1``). ``None`` is left to ``allow_null``."""
    if value is None:
        return None
    for kind, types in _JSON_TYPES:
        if isinstance(field, kind):
            if isinstance(value, bool) and bool not in types:
                return f"expected {_json_name(types[0])}, got boolean"
            if not isinstance(value, types):
                return f"expected {_json_name(types[0])}, got {_json_name(type(value))}"
            return None
    return None


def _json_name(kind: type) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object", list: "array"}.get(
        kind, kind.__name__
    )


class StrictSerializer(serializers.Serializer):
    """A JSON object body: unknown fields and wrong JSON types are refused (K3). Subclass it
    for every API body; nested serializers should subclass it too."""

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            raise serializers.ValidationError({"non_field_errors": ["expected a JSON object"]})
        errors = {name: ["unknown field"] for name in sorted(set(data) - set(self.fields))}
        for name, field in self.fields.items():
            if name in data and not field.read_only:
                problem = json_type_problem(field, data[name])
                if problem:
                    errors[name] = [problem]
        if errors:
            raise serializers.ValidationError(errors)
        return super().to_internal_value(data)


class EmptyBody(StrictSerializer):
    """The body of an action that takes no input: absent, or ``{}`` (K3: anything else is
    an unknown field)."""


_INTEGER_RE = re.compile(r"-?[0-9]{1,18}")
_DECIMAL_RE = re.compile(r"-?[0-9]{1,15}(\.[0-9]{1,9})?")


class QueryIntegerField(serializers.IntegerField):
    """A query-string integer written as decimal digits (``-?[0-9]+``), nothing else."""

    def to_internal_value(self, data):
        if not isinstance(data, str) or not _INTEGER_RE.fullmatch(data):
            self.fail("invalid")
        return super().to_internal_value(data)


class QueryFloatField(serializers.FloatField):
    """A query-string number written as a plain decimal (``2``, ``0.5``); no exponent,
    ``inf`` or ``nan``."""

    def to_internal_value(self, data):
        if not isinstance(data, str) or not _DECIMAL_RE.fullmatch(data):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictQuerySerializer(serializers.Serializer):
    """A query string: unknown or repeated parameters are refused; declare the fields with
    the ``Query*`` fields above (or string, UUID and choice fields) (K3)."""

    def to_internal_value(self, data):
        errors = {}
        values = {}
        for name in data:
            given = data.getlist(name) if hasattr(data, "getlist") else [data[name]]
            if name not in self.fields:
                errors[name] = ["unknown parameter"]
            elif len(given) != 1:
                errors[name] = ["given more than once"]
            else:
                values[name] = given[0]
        if errors:
            raise serializers.ValidationError(dict(sorted(errors.items())))
        return super().to_internal_value(values)


def valid_body(serializer_class: type[StrictSerializer], request, **context) -> dict:
    """``request.data`` validated by ``serializer_class``; raises ``ValidationError`` (400).
    An absent body counts as ``{}``."""
    data = request.data
    if hasattr(data, "getlist"):
        # An absent body parses as an empty QueryDict; DRF would read it as an HTML form
        # (a missing boolean becoming False), so hand the serializer a plain dict.
        data = data.dict()
    serializer = serializer_class(data=data, context=context)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


def valid_query(serializer_class: type[StrictQuerySerializer], request) -> dict:
    """``request.query_params`` validated by ``serializer_class``; raises ``ValidationError``."""
    serializer = serializer_class(data=request.query_params)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


class NoQuery(StrictQuerySerializer):
    """Endpoints that take no query parameters refuse any (K3)."""


def valid_message_text(value: str) -> str:
    """The text of a message to an agent, a task's (C2, C7) or a session's (T2): not only
    white space, at most ``RUNSTEAD_MESSAGE_MAX_BYTES`` of UTF-8, and no control character
    but newline and tab (``core.text``: C0, DEL, C1, the bidi controls; it may be typed
    into a terminal). Called from a serializer's ``validate_text`` (DRF runs a field's
    ``validators`` on no blank value); raises ``ValidationError`` (400 ``invalid``)."""
    from django.conf import settings

    if not value.strip():
        raise serializers.ValidationError("must not be empty")
    if (found := control_character(value)) is not None:
        raise serializers.ValidationError(f"must not contain control characters (found {found})")
    if len(value.encode()) > settings.RUNSTEAD_MESSAGE_MAX_BYTES:
        raise serializers.ValidationError(f"must be at most {settings.RUNSTEAD_MESSAGE_MAX_BYTES} bytes")
    return value
