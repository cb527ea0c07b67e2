"""docs/api.md is what the server's own OpenAPI document renders: the request schemas are the documentation."""

from pathlib import Path

import pytest

from hyserve.api_doc import COMMAND, ROUTES, markdown
from hyserve.server.app import create_app

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


@pytest.fixture(scope="module")
def openapi(make_service):
    return create_app(make_service("qwen3_5")).openapi()


def test_api_doc_is_what_the_app_documents(openapi):
    assert DOC.read_text(encoding="utf-8") == markdown(openapi), f"docs/api.md is stale: rerun `{COMMAND}`"


def test_every_route_and_body_field_has_a_row(openapi):
    text = markdown(openapi)
    sections = {s.split("\n", 1)[0]: s for s in text.split("\n## ")[1:]}
    schemas = openapi["components"]["schemas"]
    for path, ops in openapi["paths"].items():
        for method, op in ops.items():
            section = sections[f"{method.upper()} {path}"]
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            fields = schemas[body["$ref"].rsplit("/", 1)[1]]["properties"] if body else {}
            for field in fields:
                assert f"| `{field}` |" in section, f"{method.upper()} {path}: {field} has no row"
            for param in op.get("parameters", []):
                assert f"| `{param['name']}` |" in section, f"{method.upper()} {path}: {param['name']} has no row"


def test_a_route_without_a_line_stops_the_generator(openapi):
    doc = dict(openapi, paths=dict(openapi["paths"], **{"/v1/new": {"get": {"summary": "New"}}}))
    with pytest.raises(KeyError, match="GET /v1/new"):
        markdown(doc)
    assert "GET /v1/new" not in ROUTES
