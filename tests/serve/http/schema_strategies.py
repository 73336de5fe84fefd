"""Hypothesis strategies of JSON values that an OpenAPI document's JSON schemas describe: the subset FastAPI and
pydantic write ($ref, anyOf, enum, const, the JSON types with their bounds, properties and required, examples).

Values stay small (the server's limits are not the schema's), and an object holds a few of its optional
properties, not all: a body with one bad value of many would never get past it.
"""

from hypothesis import strategies as st

SMALL_INTS = st.integers(-2, 30)
MAX_OPTIONAL = 3  # optional properties drawn into one object


def from_schema(schema: dict, components: dict, pinned: dict | None = None) -> st.SearchStrategy:
    """Values of `schema`; `pinned` maps a property name to the one value it always takes (say the model)."""
    pinned = pinned or {}

    def build(s: dict) -> st.SearchStrategy:
        if "$ref" in s:
            return st.deferred(lambda: build(components[s["$ref"].rsplit("/", 1)[-1]]))
        if "anyOf" in s:
            return st.one_of([build(option) for option in s["anyOf"]])
        if "const" in s:
            return st.just(s["const"])
        if "enum" in s:
            return st.sampled_from(s["enum"])
        base = typed(s)
        return st.sampled_from(s["examples"]) | base if s.get("examples") else base

    def typed(s: dict) -> st.SearchStrategy:
        kind = s.get("type")
        if kind == "string":
            return st.text(max_size=8)
        if kind == "integer":
            low = s.get("minimum", s.get("exclusiveMinimum", -3) + ("exclusiveMinimum" in s))
            return st.integers(low, max(low, s.get("maximum", 30)))
        if kind == "number":
            if "minimum" in s or "maximum" in s:
                return st.floats(s.get("minimum"), s.get("maximum"), allow_nan=False, allow_infinity=False)
            return st.floats(0, 1) | st.floats(-3, 3)  # most sampling values live in [0, 1]
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        if kind == "array":
            items = build(s.get("items", {}))
            return st.lists(items, min_size=s.get("minItems", 0), max_size=max(s.get("minItems", 0), 3))
        if kind == "object" and "properties" in s:
            required = set(s.get("required", ())) | set(pinned) & set(s["properties"])
            fields = {name: st.just(pinned[name]) if name in pinned else build(sub)
                      for name, sub in s["properties"].items()}
            optional = sorted(set(fields) - required)
            chosen = st.lists(st.sampled_from(optional), max_size=MAX_OPTIONAL, unique=True) if optional else \
                st.just([])
            return chosen.flatmap(lambda names: st.fixed_dictionaries(
                {k: fields[k] for k in sorted(required) + names}))
        # an object without properties (a free-form dict), or no type at all: any small JSON
        return st.dictionaries(st.text(max_size=4), SMALL_INTS | st.text(max_size=4), max_size=2)

    return build(schema)
