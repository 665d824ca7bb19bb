"""The JSON schemas the structured-output tests and bench/structured.py share: varied features
(nested objects, arrays with min/max items, enums, anyOf, string patterns and lengths, number
bounds, nullable fields), each small enough that SmolLM2 completes it in ~100 tokens."""

S = {"type": "string", "minLength": 1, "maxLength": 8}

SCHEMAS = [
    {"type": "object", "properties": {"name": S}, "required": ["name"], "additionalProperties": False},
    {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99}},
        "required": ["age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["ok", "score"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["zip"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "nick": S},
                "required": ["id", "nick"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "enum": ["none"]}]}
        },
        "required": ["value"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"middle": {"type": ["string", "null"], "maxLength": 6}},
        "required": ["middle"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "array",
                "items": {"type": "number", "minimum": -10, "maximum": 10},
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["point"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 5}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0, "maximum": 50}},
        "required": ["status", "count"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "pet": {
                "oneOf": [
                    {
                        "type": "object",
                        "properties": {
                            "kind": {"const": "cat"},
                            "lives": {"type": "integer", "minimum": 1, "maximum": 9},
                        },
                        "required": ["kind", "lives"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
                        "required": ["kind", "good"],
                        "additionalProperties": False,
                    },
                ]
            }
        },
        "required": ["pet"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 5, "pattern": "^[a-z]+$"}},
        "required": ["word"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"temp": {"type": "number", "exclusiveMinimum": -5, "exclusiveMaximum": 40}},
        "required": ["temp"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9},
            "b": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 1,
                    "maxItems": 2,
                },
            }
        },
        "required": ["matrix"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"level": {"enum": [1, 2, 3]}, "label": {"enum": ["low", "high", None]}},
        "required": ["level", "label"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"}},
        "required": ["email"],
        "additionalProperties": False,
    },
    {
        "$defs": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/n"}, "y": {"$ref": "#/$defs/n"}},
        "required": ["x", "y"],
        "additionalProperties": False,
    },
]
