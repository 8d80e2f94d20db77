"""A tool's JSON schema: found in its file under the common names, or derived from its type hints and docstring.

Where the schema of the function `name` in a tool file comes from, first match wins:

  1. a `schema` attribute on the function (`lookup.schema = {...}`);
  2. a module-level TOOL_SCHEMAS, SCHEMA or TOOLS: a dict keyed by tool name, one schema, or a list of schemas
     (the one whose function name is `name`);
  3. the function itself: type hints + a Google-style docstring (`Args:` describes each parameter), read by
     `transformers.utils.get_json_schema` (as TRL does).

A schema may be written in the OpenAI function-calling form `{"type": "function", "function": {"name",
"description", "parameters"}}`, or bare (`{"name", "description", "parameters"}`, or `input_schema` in place
of `parameters`, the MCP / Anthropic spelling); it is returned in the OpenAI form, checked (`parameters` a valid
JSON schema of an object).
"""

from __future__ import annotations

import inspect

SCHEMA_NAMES = ("TOOL_SCHEMAS", "SCHEMA", "TOOLS")


class ToolLoadError(ValueError):
    """A tool file, function or schema cannot be loaded; the message names the file and the function."""


def as_function_schema(value: object) -> dict | None:
    """`value` in the OpenAI function-calling form, or None if it is not a function schema in any known form."""
    if not isinstance(value, dict):
        return None
    if value.get("type") == "function" and isinstance(value.get("function"), dict):
        return value
    if isinstance(value.get("name"), str) and ("parameters" in value or "input_schema" in value
                                               or "inputSchema" in value or "description" in value):
        parameters = value.get("parameters", value.get("input_schema", value.get("inputSchema")))
        body = {"name": value["name"], "description": value.get("description", "")}
        body["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
        return {"type": "function", "function": body}
    return None


def schema_named(collection: object, name: str) -> dict | None:
    """The schema for `name` in a module-level collection: a dict keyed by tool name, one schema, or a list."""
    if isinstance(collection, dict):
        if name in collection:
            found = as_function_schema(collection[name])
            return found if found is not None else collection[name]  # (a malformed entry: check_schema names it)
        single = as_function_schema(collection)
        return single if single is not None and single["function"].get("name") == name else None
    if isinstance(collection, (list, tuple)):
        for item in collection:
            found = as_function_schema(item)
            if found is not None and found["function"].get("name") == name:
                return found
    return None


def check_schema(schema: object, where: str) -> None:
    """An OpenAI function-calling schema whose `parameters` is a valid JSON schema of an object."""
    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(schema.get("function"), dict):
        raise ToolLoadError(f"{where}: the schema must be {{'type': 'function', 'function': {{'name', 'description', "
                            f"'parameters'}}}}, got {schema!r}")
    parameters = schema["function"].get("parameters", {"type": "object", "properties": {}})
    try:
        import jsonschema

        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except ImportError:
        pass
    except Exception as exc:  # jsonschema.SchemaError
        raise ToolLoadError(f"{where}: 'parameters' is not a valid JSON schema: {exc}") from None
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ToolLoadError(f"{where}: 'parameters' must be a JSON schema with type 'object'")


def derived_schema(function, name: str, where: str) -> dict:
    """The schema `transformers.utils.get_json_schema` derives from the function's type hints and docstring."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(function)
    except Exception as exc:  # DocstringParsingException, TypeHintParsingException
        signature = f"{name}{inspect.signature(function)}" if callable(function) else name
        raise ToolLoadError(
            f"{where}: no schema for the function '{name}' and none can be derived from it ({exc}). Fix: either give "
            f"every parameter of {signature} a type hint and describe it under 'Args:' in its docstring, e.g.\n"
            f'    def {name}(key: str) -> str:\n        """What it does.\n\n        Args:\n'
            f'            key: what the key is\n        """\n'
            f"or write its schema in the file: TOOL_SCHEMAS = {{'{name}': {{'type': 'function', 'function': "
            f"{{'name': '{name}', 'description': ..., 'parameters': {{...}}}}}}}} (SCHEMA, TOOLS or a `schema` "
            "attribute on the function are read too)") from None
    schema["function"]["name"] = name
    return schema


def find_schema(module, function, name: str, path: str) -> tuple[dict, str]:
    """(the checked schema of the tool `name`, where it was found: e.g. "TOOL_SCHEMAS['x']" or "derived")."""
    where = f"tool file {path}"
    candidates = []
    if hasattr(function, "schema"):
        candidates.append((f"{name}.schema", as_function_schema(function.schema) or function.schema))
    for attribute in SCHEMA_NAMES:
        collection = getattr(module, attribute, None)
        found = schema_named(collection, name)
        if found is not None:
            keyed = isinstance(collection, dict) and name in collection
            candidates.append((f"{attribute}['{name}']" if keyed else attribute, found))
    if not candidates:
        return derived_schema(function, name, where), "derived"
    label, schema = candidates[0]
    check_schema(schema, f"{where}, {label}")
    written = schema["function"].get("name")
    if written not in (None, name):
        raise ToolLoadError(f"{where}, {label}: the schema names the function '{written}', but the tool is '{name}' "
                            f"(the model would call '{written}'). Fix: \"name\": \"{name}\" in the schema")
    return schema, label
