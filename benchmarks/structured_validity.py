"""Structured-output validity: 50 varied, realistic JSON schemas on the bundled model; how many outputs parse and
validate (issue 11's check: 100%).

    .venv/bin/python benchmarks/structured_validity.py [--max-tokens 384] [--json out.json]

Each schema is asked for once through LLM.chat with `structured_output=StructuredOutputParams(json=schema)`,
greedy, all 50 in one batch, on LLM() (the bundled SmolLM2-135M-Instruct, packed Q4_1). An output counts as valid
when its finish_reason is "stop", it parses with json.loads, and it validates with jsonschema (Draft 2020-12, with
the format checkers jsonschema has installed). The schemas cover nested objects, arrays with minItems/maxItems,
enums, const, integer/number ranges, string maxLength/pattern/format, anyOf/nullable, $defs/$ref (one recursive),
prefixItems, required subsets and additionalProperties false. Strings and arrays are bounded, as strict API
schemas usually are: a 135M model under greedy decoding can otherwise repeat inside one string until max_tokens.
Not covered: `uniqueItems` (llguidance refuses it: the request is a 400 naming structured_output, never ignored).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

Schema = dict[str, Any]


def s(max_length: int = 24, **kw: Any) -> Schema:
    return {"type": "string", "maxLength": max_length, **kw}


def i(lo: int, hi: int) -> Schema:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def n(lo: float, hi: float) -> Schema:
    return {"type": "number", "minimum": lo, "maximum": hi}


def e(*values: Any) -> Schema:
    return {"enum": list(values)}


def arr(items: Schema, lo: int, hi: int, **kw: Any) -> Schema:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi, **kw}


def nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def obj(props: dict[str, Schema], required: list[str] | None = None, **kw: Any) -> Schema:
    """An object with additionalProperties false; `required` None = every property."""
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}


B: Schema = {"type": "boolean"}
EMAIL = s(40, format="email")
HHMM = s(5, pattern=r"^([01][0-9]|2[0-3]):[0-5][0-9]$")
PERSON = obj({"name": s(), "age": i(0, 120), "email": EMAIL}, ["name", "age"])
MONEY = obj({"amount": n(0, 1_000_000), "currency": e("USD", "EUR", "GBP")})
ADDRESS = obj({"street": s(40), "city": s(), "postal_code": s(5, pattern=r"^[0-9]{5}$"),
               "country": e("US", "FR", "DE", "JP")})

# (task for the prompt, schema)
CASES: list[tuple[str, Schema]] = [
    ("Describe a person named Ann, 34 years old.", PERSON),
    ("Give the address of a museum.", ADDRESS),
    ("Describe a product in an online shop.", obj({
        "sku": s(8, pattern=r"^[A-Z]{3}-[0-9]{4}$"), "name": s(), "price": n(0, 10_000), "in_stock": B,
        "tags": arr(s(12), 0, 4)})),
    ("Write an order of two items.", {"$defs": {"item": obj({"sku": s(12), "qty": i(1, 99)})},
                                      **obj({"items": arr({"$ref": "#/$defs/item"}, 1, 3), "total": n(0, 1e5)})}),
    ("Describe a team meeting.", obj({"title": s(40), "date": s(10, format="date"),
                                      "attendees": arr(s(20), 1, 4), "location": nullable(s(30))})),
    ("Report the weather in Oslo.", obj({"city": s(), "temperature_c": n(-60, 60),
                                         "condition": e("sunny", "cloudy", "rain", "snow"), "humidity": i(0, 100)})),
    ("Review the movie Casablanca.", obj({"title": s(40), "rating": i(1, 5), "recommend": B, "summary": s(80)})),
    ("Describe a classic novel.", obj({"kind": {"const": "book"}, "title": s(40), "authors": arr(s(), 1, 3),
                                       "year": i(1450, 2025), "isbn": s(13, pattern=r"^97[89][0-9]{10}$")})),
    ("Describe a web server's network settings.", obj({"hostname": s(30, format="hostname"),
                                                       "ip": s(15, format="ipv4"), "port": i(1, 65535),
                                                       "protocol": e("tcp", "udp")})),
    ("Create a user account for an editor.", obj({
        "username": s(16, pattern=r"^[a-z][a-z0-9_]{2,15}$"), "role": e("admin", "editor", "viewer"),
        "active": B, "last_login": nullable(s(25, format="date-time"))})),
    ("Give a pancake recipe.", obj({"name": s(30), "servings": i(1, 12), "vegetarian": B, "ingredients": arr(
        obj({"name": s(20), "amount": n(0, 1000), "unit": e("g", "ml", "cup", "tbsp", "tsp", "piece")}), 1, 5)})),
    ("Show a small folder tree.", {"$defs": {"node": obj({"name": s(16), "children": arr(
        {"$ref": "#/$defs/node"}, 0, 2)})}, "$ref": "#/$defs/node"}),
    ("Give the location of the Eiffel Tower.", obj({"lat": n(-90, 90), "lon": n(-180, 180),
                                                    "label": nullable(s(30))})),
    ("Suggest a color palette for a website.", obj({"colors": arr(s(7, pattern=r"^#[0-9a-f]{6}$"), 2, 5)})),
    ("Write a to-do list for moving house.", arr(obj({"title": s(30), "done": B,
                                                      "priority": e("low", "medium", "high")}), 1, 4)),
    ("Write an invoice for a consulting job.", {"$defs": {"money": MONEY}, **obj({
        "subtotal": {"$ref": "#/$defs/money"}, "tax": {"$ref": "#/$defs/money"},
        "total": {"$ref": "#/$defs/money"}, "due_date": s(10, format="date")})}),
    ("Give a way to contact support.", obj({"contact": {"anyOf": [
        obj({"email": EMAIL}), obj({"phone": s(13, pattern=r"^\+[0-9]{8,12}$")})]}})),
    ("Classify the sentiment of: 'I loved this phone.'", obj({"label": e("positive", "negative", "neutral"),
                                                              "confidence": n(0, 1)})),
    ("Extract the named entities of: 'Marie Curie worked in Paris for the Sorbonne.'", obj({"entities": arr(
        obj({"text": s(30), "type": e("PERSON", "ORG", "LOC")}), 0, 4)})),
    ("Translate 'good morning' into French.", obj({"source_lang": e("en", "fr", "de", "es"),
                                                   "target_lang": e("en", "fr", "de", "es"), "text": s(100)})),
    ("Describe an HTTP request that creates a user.", obj({
        "method": e("GET", "POST", "PUT", "DELETE"), "path": s(31, pattern=r"^/[a-z0-9/_-]{0,30}$"),
        "headers": {"type": "object", "additionalProperties": s(40), "maxProperties": 3}})),
    ("Give the version of a software release.", obj({"version": s(14, pattern=r"^[0-9]{1,4}\.[0-9]{1,4}\.[0-9]{1,4}$"),
                                                     "prerelease": B})),
    ("Describe a flight from Paris to New York.", obj({
        "flight_number": s(6, pattern=r"^[A-Z]{2}[0-9]{2,4}$"), "from": s(3, pattern=r"^[A-Z]{3}$"),
        "to": s(3, pattern=r"^[A-Z]{3}$"), "departure": s(25, format="date-time"), "seats_left": i(0, 500)})),
    ("Describe an employee with home and work addresses.", {"$defs": {"address": ADDRESS}, **obj({
        "name": s(), "home": {"$ref": "#/$defs/address"}, "work": nullable({"$ref": "#/$defs/address"})})}),
    ("Solve 17 * 23 and show your steps.", obj({"expression": s(40), "result": i(-1_000_000, 1_000_000),
                                                "steps": arr(s(60), 1, 3)})),
    ("Write a multiple-choice question about planets.", obj({"question": s(80), "options": arr(s(30), 4, 4),
                                                             "answer_index": i(0, 3)})),
    ("Give the coordinates of Rome as [lat, lon].", {"type": "array", "prefixItems": [n(-90, 90), n(-180, 180)],
                                                     "items": False, "minItems": 2}),
    ("Write an API error for a missing resource.", obj({"code": i(100, 599), "message": s(60),
                                                        "details": nullable(obj({"resource": s(30)}))})),
    ("Give the feature flags of a mobile app.", obj({"dark_mode": B, "beta": B, "notifications": B})),
    ("Suggest an opening chess move.", obj({"from": s(2, pattern=r"^[a-h][1-8]$"),
                                            "to": s(2, pattern=r"^[a-h][1-8]$"),
                                            "promotion": nullable(e("q", "r", "b", "n"))})),
    ("Give a stock quote for Apple.", obj({"ticker": s(5, pattern=r"^[A-Z]{1,5}$"), "price": n(0, 1e5),
                                           "change_pct": n(-100, 100), "currency": {"const": "USD"}})),
    ("Give the RGB values of orange.", obj({"r": i(0, 255), "g": i(0, 255), "b": i(0, 255)})),
    ("Give the opening hours of a bakery.", obj({"opens": HHMM, "closes": HHMM, "closed_on": arr(
        e("mon", "tue", "wed", "thu", "fri", "sat", "sun"), 0, 2)})),
    ("Describe a data file.", obj({"filename": s(25, pattern=r"^[a-z0-9_-]{1,20}\.(txt|csv|json)$"),
                                   "size_bytes": i(0, 10**9), "mime": e("text/plain", "text/csv",
                                                                        "application/json")})),
    ("Record a survey response.", obj({"respondent_id": s(36, format="uuid"), "answers": arr(i(1, 5), 3, 5),
                                       "comment": nullable(s(60))})),
    ("Write an application config.", obj({
        "db": obj({"host": s(30), "port": i(1, 65535), "user": s(16)}),
        "cache": obj({"enabled": B, "ttl_s": i(0, 86400)}), "debug": B})),
    ("Describe a laptop; only brand and price are needed.", obj({
        "brand": s(20), "model": s(20), "price": n(0, 10_000), "weight_kg": n(0, 10)}, ["brand", "price"])),
    ("Describe a company and its CEO.", obj({"company": obj({"name": s(30), "ceo": obj({
        "name": s(), "contact": obj({"email": EMAIL})})})})),
    ("Pick a value.", obj({"value": e(1, "two", None, True)})),
    ("Describe a shape.", obj({"shape": {"anyOf": [
        obj({"type": {"const": "circle"}, "radius": n(0, 100)}),
        obj({"type": {"const": "rect"}, "width": n(0, 100), "height": n(0, 100)})]}})),
    ("Give a small matrix of digits.", obj({"matrix": arr(arr(i(0, 9), 2, 3), 2, 3)})),
    ("Give the pagination of a search result.", obj({
        "page": i(1, 1000), "per_page": e(10, 20, 50), "total": i(0, 1_000_000),
        "next_url": nullable(s(60, format="uri"))})),
    ("Write a short email to a colleague about lunch.", obj({
        "to": arr(EMAIL, 1, 3), "subject": s(60), "body": s(200), "priority": e("low", "normal", "high")})),
    ("Write a log entry for a failed login.", obj({
        "level": e("DEBUG", "INFO", "WARN", "ERROR"), "timestamp": s(25, format="date-time"), "message": s(80),
        "context": obj({"user": s(20), "ip": s(15, format="ipv4")}, ["user"])})),
    ("Give a student's grades.", obj({"student": s(), "scores": obj({
        "math": i(0, 100), "science": i(0, 100), "english": i(0, 100)}), "passed": B})),
    ("Show a query result with two columns.", obj({"columns": arr(s(20), 1, 3), "rows": arr(
        arr({"type": ["string", "number", "null"], "maxLength": 20}, 1, 3), 0, 3)})),
    ("Convert 5 miles to kilometers.", obj({"value": n(-1e6, 1e6), "from_unit": e("mi", "km", "m", "ft"),
                                            "to_unit": e("mi", "km", "m", "ft"), "result": n(-1e6, 1e6)})),
    ("Give my free time slots on Monday.", obj({"day": e("monday", "tuesday", "wednesday", "thursday", "friday"),
                                                "slots": arr(obj({"start": HHMM, "end": HHMM}), 1, 3)})),
    ("Tag a blog post about cooking.", obj({"tags": arr(e("food", "travel", "tech", "health", "diy"), 1, 3)})),
    ("Describe a pet and its owner.", {"$defs": {"person": PERSON}, **obj({
        "name": s(), "species": e("dog", "cat", "bird", "fish"), "age": i(0, 40), "vaccinated": B,
        "owner": {"$ref": "#/$defs/person"}})}),
]


def check(schema: Schema, text: str, finish_reason: str | None) -> str | None:
    """None when the output is valid; else why not."""
    import jsonschema

    if finish_reason != "stop":
        return f"finish_reason {finish_reason}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return f"does not parse: {err}"
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    errors = sorted(validator.iter_errors(value), key=str)
    return f"invalid: {errors[0].message}" if errors else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--json", default=None, help="write every output and verdict here")
    p.add_argument("--only", type=int, nargs="+", default=None, help="run only these case indices (diagnosis)")
    ns = p.parse_args()
    assert len(CASES) == 50, len(CASES)
    cases = [CASES[k] for k in ns.only] if ns.only else CASES

    from loom import LLM, SamplingParams
    from loom.sampling_params import StructuredOutputParams

    t0 = time.perf_counter()
    llm = LLM()  # bundled SmolLM2-135M-Instruct, packed Q4_1
    load_s = time.perf_counter() - t0
    convs = [[{"role": "user", "content": f"{task} Reply with JSON only, matching this JSON schema: "
                                          f"{json.dumps(schema)}"}] for task, schema in cases]
    params = [SamplingParams(temperature=0.0, max_tokens=ns.max_tokens,
                             structured_output=StructuredOutputParams(json=schema)) for _, schema in cases]
    t1 = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    gen_s = time.perf_counter() - t1
    records = []
    for k, ((task, schema), out) in enumerate(zip(cases, outs, strict=True)):
        c = out.outputs[0]
        why = check(schema, c.text, c.finish_reason)
        records.append({"index": k, "task": task, "finish_reason": c.finish_reason, "tokens": len(c.token_ids),
                        "text": c.text, "error": why})
        if why:
            print(f"[{k}] {task}: {why}\n    {c.text[:300]!r}")
    valid = sum(r["error"] is None for r in records)
    tokens = sum(r["tokens"] for r in records)
    print(f"valid {valid}/{len(cases)}  ({100 * valid / len(cases):.0f}%)  output tokens {tokens}  "
          f"load {load_s:.1f} s  generate {gen_s:.1f} s")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"valid": valid, "total": len(cases), "generate_s": gen_s, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
