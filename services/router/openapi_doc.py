"""The HTTP API as an OpenAPI 3.1 document (``GET /openapi.json``): its request bodies are
the pydantic models that validate them."""

from __future__ import annotations

from typing import Any

from services.router.openai_schema import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody
from services.router.responses_schema import ResponseBody


def openapi_document(version: str) -> dict[str, Any]:
    """The HTTP API as OpenAPI 3.1."""
    schemas: dict[str, Any] = {}
    for model in (ChatBody, CompletionBody, ResponseBody, TokenizeBody, DetokenizeBody):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    error = {"$ref": "#/components/schemas/Error"}
    schemas["Error"] = _ERROR_SCHEMA
    return {
        "openapi": "3.1.0",
        "info": {"title": "llm-mesh router", "version": version},
        "paths": {
            "/v1/chat/completions": _generation("ChatBody", "A chat completion", error),
            "/v1/completions": _generation("CompletionBody", "A text completion", error),
            "/v1/responses": _generation("ResponseBody", "A response (Responses API)", error),
            "/v1/responses/{response_id}": _stored_response(error),
            "/v1/responses/{response_id}/input_items": _input_items(error),
            "/v1/models": {
                "get": {
                    "summary": "The models the caller may use",
                    "security": [{"bearer": []}],
                    "responses": {"200": {"description": "A list of models"}, "401": _err(error)},
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "summary": "A model the caller may use",
                    "security": [{"bearer": []}],
                    "parameters": [
                        {
                            "name": "model",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {
                        "200": {"description": "The model"},
                        "401": _err(error),
                        "404": _err(error),
                    },
                }
            },
            "/tokenize": _json_call("TokenizeBody", "A prompt's or messages' tokens", error),
            "/detokenize": _json_call("DetokenizeBody", "Tokens' text", error),
            "/health": _probe("200 while some replica of some model can serve", error),
            "/ping": _probe("As /health", error),
            "/version": _probe("The mesh's version", error),
            "/metrics": {
                "get": {
                    "summary": "The router's Prometheus metrics (with the mesh's token)",
                    "responses": {"200": {"description": "Prometheus text"}, "401": _err(error)},
                }
            },
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _err(schema: dict[str, str]) -> dict[str, Any]:
    return {
        "description": "OpenAI's error JSON",
        "content": {"application/json": {"schema": schema}},
    }


def _stored_response(error: dict[str, str]) -> dict[str, Any]:
    path = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    statuses = {"401": _err(error), "404": _err(error), "503": _err(error)}
    call = {"security": [{"bearer": []}], "parameters": path}
    return {
        "get": {
            "summary": "A stored response",
            **call,
            "responses": {"200": {"description": "The response object"}, **statuses},
        },
        "delete": {
            "summary": "Deletes a stored response",
            **call,
            "responses": {"200": {"description": "Deleted"}, **statuses},
        },
    }


def _input_items(error: dict[str, str]) -> dict[str, Any]:
    path = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    query = [
        {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
        {
            "name": "limit",
            "in": "query",
            "schema": {"type": "integer", "minimum": 1, "maximum": 100},
        },
        {"name": "after", "in": "query", "schema": {"type": "string"}},
    ]
    statuses = {code: _err(error) for code in ("400", "401", "404", "503")}
    return {
        "get": {
            "summary": "The input items of a stored response, a page at a time",
            "security": [{"bearer": []}],
            "parameters": [path, *query],
            "responses": {"200": {"description": "A list of items"}, **statuses},
        }
    }


def _probe(summary: str, error: dict[str, str]) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "responses": {"200": {"description": summary}, "503": _err(error)},
        }
    }


def _json_call(body: str, summary: str, error: dict[str, str]) -> dict[str, Any]:
    statuses = ("400", "401", "403", "404", "408", "413", "415", "503")
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}
                },
            },
            "responses": {
                "200": {"description": summary, "content": {"application/json": {}}},
                **{status: _err(error) for status in statuses},
            },
        }
    }


def _generation(body: str, summary: str, error: dict[str, str]) -> dict[str, Any]:
    statuses = ("400", "401", "403", "404", "408", "409", "413", "415", "429", "503", "504")
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}],
            "parameters": [
                {"name": name, "in": "header", "required": False, "schema": {"type": "string"}}
                for name in ("x-request-id", "x-session-id", "x-llm-color")
            ],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}
                },
            },
            "responses": {
                "200": {
                    "description": "The completion: JSON, or server-sent events with stream",
                    "content": {"application/json": {}, "text/event-stream": {}},
                },
                **{status: _err(error) for status in statuses},
            },
        }
    }


_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}
