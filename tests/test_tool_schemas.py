"""Tool schemas (workers/rollout/tool_schemas.py): derived from type hints and a docstring, or found in the file
under TOOL_SCHEMAS, SCHEMA, TOOLS or a `schema` attribute, in the OpenAI or the bare form; errors name the file,
the function and the fix; a tool file written either way is accepted by config validation."""

from __future__ import annotations

import textwrap

import pytest

from rlframe.workers.rollout.tools import ToolLoadError, load_tool

LOOKUP_PARAMETERS = {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_a_typed_function_with_a_docstring_needs_no_schema(tmp_path):
    path = write(tmp_path, "typed.py", '''
        def lookup(key: str, limit: int = 3) -> str:
            """Look a key up in the table.

            Args:
                key: the key to find
                limit: how many rows to return
            """
            return f"{key}:{limit}"
        ''')
    tool = load_tool(path, "lookup")
    function = tool.schema["function"]
    assert tool.schema["type"] == "function" and function["name"] == "lookup"
    assert function["description"] == "Look a key up in the table."
    assert function["parameters"]["properties"] == {"key": {"type": "string", "description": "the key to find"},
                                                    "limit": {"type": "integer", "description": "how many rows to return"}}
    assert function["parameters"]["required"] == ["key"] and tool.first_required() == "key"
    assert tool.function(key="a") == "a:3"


@pytest.mark.parametrize("spelling", [
    # the form the new user wrote: one schema in SCHEMA (refused before, until TOOL_SCHEMAS was added)
    'SCHEMA = {"type": "function", "function": {"name": "lookup", "description": "d", "parameters": P}}',
    'SCHEMA = {"name": "lookup", "description": "d", "parameters": P}',  # bare
    'TOOLS = [{"name": "other", "parameters": P}, {"type": "function", "function": {"name": "lookup", "parameters": P}}]',
    'TOOL_SCHEMAS = {"lookup": {"name": "lookup", "description": "d", "input_schema": P}}',  # the MCP spelling
    'lookup.schema = {"type": "function", "function": {"name": "lookup", "description": "d", "parameters": P}}',
])
def test_hand_written_schemas_under_the_common_names(tmp_path, spelling):
    path = write(tmp_path, "hand.py", f"""
        P = {LOOKUP_PARAMETERS!r}

        def lookup(key):  # no hints, no docstring: the written schema is used
            return key

        {spelling}
        """)
    tool = load_tool(path, "lookup")
    assert tool.schema["type"] == "function" and tool.schema["function"]["name"] == "lookup"
    assert tool.parameters == LOOKUP_PARAMETERS


def test_errors_name_the_file_the_function_and_the_fix(tmp_path):
    untyped = write(tmp_path, "untyped.py", """
        def lookup(key):
            '''Find a key.'''
            return key
        """)
    with pytest.raises(ToolLoadError) as error:
        load_tool(untyped, "lookup")
    text = str(error.value)
    assert untyped in text and "'lookup'" in text and "missing a type hint" in text
    assert "Fix:" in text and "Args:" in text and "TOOL_SCHEMAS = {'lookup'" in text

    undocumented = write(tmp_path, "undocumented.py", "def lookup(key: str) -> str:\n    return key\n")
    with pytest.raises(ToolLoadError, match="no docstring"):
        load_tool(undocumented, "lookup")

    misnamed = write(tmp_path, "misnamed.py", f"""
        def lookup(key):
            return key

        SCHEMA = {{"other": {{"name": "lookup2", "parameters": {LOOKUP_PARAMETERS!r}}},
                   "lookup": {{"name": "find", "parameters": {LOOKUP_PARAMETERS!r}}}}}
        """)
    with pytest.raises(ToolLoadError) as error:
        load_tool(misnamed, "lookup")
    assert "SCHEMA['lookup']" in str(error.value) and "names the function 'find'" in str(error.value)

    bad = write(tmp_path, "bad.py", """
        def lookup(key):
            return key

        TOOL_SCHEMAS = {"lookup": {"name": "lookup", "parameters": {"type": "array"}}}
        """)
    with pytest.raises(ToolLoadError, match=r"TOOL_SCHEMAS\['lookup'\]: 'parameters' must be a JSON schema with type"):
        load_tool(bad, "lookup")


def test_config_validation_accepts_a_schema_in_SCHEMA(tmp_path):
    """The issue's report: a tool file with its schema in SCHEMA passes validation (named in the config)."""
    from rlframe.config import RLConfig, ToolConfig, validate_config

    path = write(tmp_path, "user_tool.py", f"""
        SCHEMA = {{"type": "function", "function": {{"name": "lookup", "description": "d",
                                                       "parameters": {LOOKUP_PARAMETERS!r}}}}}

        def lookup(key):
            return key
        """)
    cfg = RLConfig()
    cfg.rollout.multi_turn.enable = True
    cfg.rollout.multi_turn.tools = [ToolConfig(path=path, name="lookup")]
    validate_config(cfg)
