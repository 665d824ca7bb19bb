"""`splitserve usage`: token usage per API key id, model and month, from the Redis the routers
share (router/tenancy/ writes it at the end of every request).

    splitserve usage --redis-url redis://host:6379 [--period 2026-11] [--key-id team-a] [--json]
"""

from __future__ import annotations

import asyncio
import json
import re


def register(subparsers) -> None:
    p = subparsers.add_parser("usage", help="print token usage per API key id, model and month")
    p.add_argument("--redis-url", required=True, help="the Redis the routers share (redis:// or rediss://)")
    p.add_argument("--prefix", default="splitserve", help="the routers' index.key_prefix (default splitserve)")
    p.add_argument("--period", default=None, help="only this month, YYYY-MM (UTC)")
    p.add_argument("--key-id", default=None, help="only this key id")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    p.set_defaults(func=cmd_usage)


COLUMNS = ("period", "key_id", "model", "requests", "prompt_tokens", "cached_tokens", "completion_tokens")


def format_table(rows: list[dict]) -> str:
    head = [*COLUMNS, "total_tokens"]
    cells = [[str(r[c]) for c in COLUMNS] + [str(r["prompt_tokens"] + r["completion_tokens"])] for r in rows]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(head)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += [
        "  ".join(v.rjust(w) if i >= 3 else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths, strict=True)))
        for row in cells
    ]
    return "\n".join(lines)


async def read_rows(redis_url: str, prefix: str) -> list[dict]:
    from prometheus_client import CollectorRegistry

    from splitserve.router.tenancy.quota import Quota

    quota = Quota(CollectorRegistry(), redis_url, prefix)
    try:
        return await quota.usage_table()
    finally:
        await quota.close()


def cmd_usage(args) -> int:
    if not re.match(r"^rediss?://", args.redis_url):
        raise SystemExit(f"splitserve usage: --redis-url={args.redis_url!r} must start with redis:// or rediss://")
    if args.period and not re.fullmatch(r"\d{4}-\d{2}", args.period):
        raise SystemExit(f"splitserve usage: --period={args.period!r}: need YYYY-MM")
    rows = asyncio.run(read_rows(args.redis_url, args.prefix))
    rows = [
        r
        for r in rows
        if (not args.period or r["period"] == args.period) and (not args.key_id or r["key_id"] == args.key_id)
    ]
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(format_table(rows))
    return 0
