"""Hypothesis strategies for hostile requests to `tandem serve`, each guaranteed invalid: a valid
body with one hostile mutation (a wrong type, an out-of-range or huge number, an unknown field,
a missing field, a bad prompt or chat message, deep nesting), raw bytes that are no valid request,
odd methods and paths. A mutation is ``{field: value}`` to set (value `DROP` removes the field)."""

import json

from hypothesis import strategies as st

from tandem.server.protocol import ChatCompletionRequest, CompletionRequest

MAX_INT = 2**63 - 1
VOCAB = 512  # the tiny model's
DROP = object()
KNOWN = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)

leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
json_value = st.recursive(
    leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4)
)
containers = st.lists(leaf, max_size=3) | st.dictionaries(st.text(), leaf, max_size=3)
WRONG = {  # strict schemas (no coercion): each of these is the wrong type for the kind
    "str": st.integers() | st.floats(allow_nan=False) | st.booleans() | containers,
    "int": st.text() | st.floats(allow_nan=False) | st.booleans() | containers,
    "float": st.text() | st.booleans() | containers,
    "bool": st.integers() | st.text() | st.floats(allow_nan=False) | containers,
}
SAMPLING = {  # field -> (kind, nullable: null means the default, (min, max))
    "model": ("str", False, None),
    "max_tokens": ("int", True, (1, MAX_INT)),
    "temperature": ("float", True, (0, 2)),
    "top_p": ("float", True, (0, 1)),  # > 0
    "top_k": ("int", True, (-1, MAX_INT)),
    "n": ("int", True, (1, 64)),
    "seed": ("int", True, (0, MAX_INT)),
    "stream": ("bool", True, None),
    "presence_penalty": ("float", True, (-2, 2)),
    "frequency_penalty": ("float", True, (-2, 2)),
    "user": ("str", True, None),
    "ignore_eos": ("bool", False, None),
    "include_stop_str_in_output": ("bool", False, None),
    "skip_special_tokens": ("bool", False, None),
    "priority": ("int", False, (-(2**31), 2**31 - 1)),
}
COMPLETION = SAMPLING | {
    "logprobs": ("int", True, (0, 20)),
    "echo": ("bool", True, None),
    "best_of": ("int", True, (1, 64)),
}
CHAT = SAMPLING | {
    "max_completion_tokens": ("int", True, (1, MAX_INT)),
    "logprobs": ("bool", True, None),
    "top_logprobs": ("int", True, (0, 20)),
    "add_generation_prompt": ("bool", False, None),
}


def wrong_type(kind: str, nullable: bool = False):
    return WRONG[kind] if nullable else WRONG[kind] | st.none()


def out_of_range(lo: int, hi: int):
    huge = st.integers(min_value=19, max_value=400).map(lambda k: 10**k)
    above = st.integers(min_value=hi + 1) | st.floats(min_value=hi + 1e-3) | huge
    return above | st.integers(max_value=lo - 1) | st.floats(max_value=lo - 1e-3)


class Deep:
    """``{"a": [{"a": [...]}]}`` nested ``depth`` times; written by `encode` (json cannot)."""

    def __init__(self, depth: int):
        self.depth = depth

    def __repr__(self) -> str:
        return f"Deep({self.depth})"

    def json(self) -> str:
        opens = ["[" if i % 2 else '{"a":' for i in range(self.depth)]
        return (
            "".join(reversed(opens))
            + "1"
            + "".join("]" if i % 2 else "}" for i in range(self.depth))
        )


deep = st.builds(Deep, st.integers(min_value=3, max_value=3000))


def field_mutation(fields: dict):
    def per_field(name: str):
        kind, nullable, bounds = fields[name]
        values = wrong_type(kind, nullable) | deep
        if bounds is not None:
            values |= out_of_range(*bounds)
        return values.map(lambda v: {name: v})

    return st.sampled_from(sorted(fields)).flatmap(per_field)


def mutations(fields: dict, required: list[str], *specific):
    unknown = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,30}", fullmatch=True)
    return st.one_of(
        field_mutation(fields),
        st.builds(lambda k, v: {k: v}, unknown.filter(lambda k: k not in KNOWN), json_value),
        st.sampled_from(required).map(lambda f: {f: DROP}),
        st.text(max_size=40).map(lambda m: {"model": "not-" + m}),  # another model: 404
        *specific,
    )


def prompts(context: int):
    ids = st.integers(min_value=0, max_value=VOCAB - 1)
    return st.one_of(
        st.sampled_from(["", [], [[]], [""], ["ok", ""], "\ud800", ["ok", "\udfff"]]),
        st.lists(st.integers(max_value=-1), min_size=1, max_size=4),  # negative token ids
        st.lists(st.integers(min_value=VOCAB), min_size=1, max_size=4),  # outside the vocab
        st.lists(ids, min_size=context, max_size=4 * context),  # no room under the context
        st.integers(min_value=context, max_value=4000).map(lambda n: "lorem ipsum " * n),
        st.lists(st.just("x"), min_size=65, max_size=70),  # more than 64 prompts
        st.tuples(ids, st.text(min_size=1)).map(list),  # ids and text mixed
        wrong_type("str").filter(lambda v: not isinstance(v, list)),
        deep,
    )


def completion_mutations(context: int):
    return mutations(
        COMPLETION,
        ["model", "prompt"],
        prompts(context).map(lambda p: {"prompt": p}),
        st.sampled_from(["x" * 257, "", ["s"] * 17, [""]]).map(lambda s: {"stop": s}),
        st.lists(st.integers(max_value=-1), min_size=1).map(lambda s: {"stop_token_ids": s}),
        st.text()
        .filter(lambda m: m not in ("raw", "processed"))
        .map(lambda m: {"logprobs_mode": m}),
        st.dictionaries(st.text(), st.floats(1, 9), min_size=1).map(lambda b: {"logit_bias": b}),
        st.text(min_size=1).map(lambda s: {"suffix": s}),
        st.just({"stream": False, "stream_options": {"include_usage": True}}),
        st.just({"echo": False, "max_tokens": 0}),
        st.just({"detokenize": False, "stop": "x"}),
        st.sampled_from(["", "a b", "x/y", "semi;colon", "a" * 257, "new\nline"]).map(
            lambda s: {"request_id": s}
        ),
    )


def chat_mutations(context: int):
    role = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
    roles = ("system", "developer", "user", "assistant", "tool")
    part = st.fixed_dictionaries(
        {"type": st.text().filter(lambda t: t != "text"), "text": st.text()}
    )
    message = st.one_of(
        wrong_type("str").filter(lambda v: not isinstance(v, dict)),  # not an object
        st.fixed_dictionaries({"content": st.text()}),  # no role
        st.fixed_dictionaries(
            {"role": st.text().filter(lambda r: r not in roles) | wrong_type("str")}
        ),
        st.fixed_dictionaries(
            {
                "role": role,
                "content": st.integers() | st.booleans() | st.dictionaries(st.text(), leaf),
            }
        ),
        st.fixed_dictionaries({"role": role, "content": st.lists(part | leaf, min_size=1)}),
        st.fixed_dictionaries({"role": role, "content": st.text(), "name": st.integers()}),
        st.integers(min_value=context, max_value=4000).map(
            lambda n: {"role": "user", "content": "lorem ipsum " * n}  # over the context
        ),
    )
    not_messages = wrong_type("str") | st.just([])
    return mutations(
        CHAT,
        ["model", "messages"],
        message.map(lambda m: {"messages": [{"role": "user", "content": "hi"}, m]}),
        not_messages.filter(lambda v: v == [] or not isinstance(v, list)).map(
            lambda v: {"messages": v}
        ),
        st.lists(json_value, min_size=1).map(lambda t: {"tools": t}),
        st.sampled_from([{"type": "json_object"}, {"type": "json_schema"}, {}]).map(
            lambda f: {"response_format": f}
        ),
        st.sampled_from(["auto", "required", {"type": "function"}]).map(
            lambda c: {"tool_choice": c}
        ),
        st.just({"logprobs": False, "top_logprobs": 2}),
    )


def apply(base: dict, mutation: dict) -> dict:
    body = base | mutation
    return {k: v for k, v in body.items() if v is not DROP}


def encode(body) -> bytes:
    """JSON bytes, ASCII (lone surrogates as escapes), Infinity kept, `Deep` values written."""
    deep: list[Deep] = []

    def placeholder(value: Deep) -> str:
        deep.append(value)
        return f"@deep{len(deep) - 1}@"

    text = json.dumps(body, default=placeholder)
    for i, value in enumerate(deep):
        text = text.replace(f'"@deep{i}@"', value.json())
    return text.encode()


INVALID_UTF8 = [
    b"\xff",
    b"\xfe\xff",
    b"\xc0\xaf",
    b"\xed\xa0\x80",
    b"\xf8\x88\x80\x80\x80",
    b"\x80",
    b"\xe2\x82",
    b"\xf4\x90\x80\x80",
]


def raw_bodies(valid: dict, max_request_bytes: int):
    """Bytes that are no valid request: ``valid`` broken, or junk."""
    whole = encode(valid)
    head, tail = encode(valid | {"prompt": "@"}).split(b"@")
    with_bytes = st.tuples(st.sampled_from(INVALID_UTF8), st.text(max_size=8))
    return st.one_of(
        st.binary(max_size=300),
        st.integers(min_value=0, max_value=len(whole) - 1).map(lambda i: whole[:i]),  # truncated
        with_bytes.map(lambda bt: head + bt[0] + bt[1].encode() + tail),  # in the prompt
        st.sampled_from(INVALID_UTF8).map(lambda b: b'"' + b + b'"'),
        json_value.filter(lambda v: not isinstance(v, dict)).map(encode),  # not an object
        st.integers(min_value=100, max_value=40000).map(lambda n: b"[" * n + b"]" * n),
        st.integers(min_value=100, max_value=20000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
        st.integers(min_value=1, max_value=4096).map(  # over max_request_bytes: 413
            lambda n: encode(valid | {"user": "x" * (max_request_bytes + n)})
        ),
    )


ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"]
ADMIN = [
    "/admin/weights",
    "/sleep",
    "/wake_up",
    "/reset_prefix_cache",
    "/pause",
    "/resume",
    "/abort_requests",
]


def odd_requests(admin_key: str):
    """(method, path, headers): wrong methods, unknown paths, admin routes without the key."""
    path = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._~%/", max_size=60)
    unknown = path.map(lambda p: "/" + p).filter(
        lambda p: p not in ROUTES + ADMIN and p[:-1] not in ROUTES + ADMIN  # no slash redirect
    )
    bad_keys = [
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": admin_key},
        {"authorization": f"Basic {admin_key}"},
        {"authorization": f"Bearer {admin_key[:-1]}"},
        {"authorization": f"Bearer {admin_key}x"},
        {"authorization": b"Bearer \xff\xfe"},
    ]
    no_headers = st.just({})
    return st.one_of(
        st.tuples(
            st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "PROPFIND"]),
            st.sampled_from(ROUTES[:2]),
            no_headers,
        ),
        st.tuples(
            st.sampled_from(["POST", "PUT", "DELETE"]), st.sampled_from(ROUTES[2:]), no_headers
        ),
        st.tuples(st.sampled_from(["GET", "POST", "PUT", "DELETE"]), unknown, no_headers),
        st.tuples(
            st.sampled_from(["GET", "POST"]), st.sampled_from(ADMIN), st.sampled_from(bad_keys)
        ),
    )
