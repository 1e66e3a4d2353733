"""`hostagent token issue`: bearer tokens, written to the local journal: one bound to a VM's domain UUID, or an
operator token.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from hostagent.cli.common import EXIT_OK, EXIT_USAGE, add_common_options, die, emit, settings_for


def cmd_token_issue(args: argparse.Namespace) -> int:
    """Issue a bearer token for one VM (bound to its domain UUID) or for an operator."""
    from hostagent.adapters import open_hypervisor
    from hostagent.store.journal import Journal
    from hostagent.web.auth import hash_token, new_token

    settings = settings_for(args)
    journal = Journal(settings.state_dir / "journal.sqlite3")
    try:
        if args.operator:
            token = new_token("op")
            journal.add_token(hash_token(token), role="operator", domain_uuid=None, domain_name=None)
            data = {"role": "operator", "token": token}
        else:
            if not args.domain:
                return die("name the VM with --domain NAME|UUID (or pass --operator)", EXIT_USAGE)
            hv = open_hypervisor(settings)

            async def lookup() -> Any:
                try:
                    return await hv.get_domain(args.domain)
                finally:
                    await hv.close()

            dom = asyncio.run(lookup())
            token = new_token("vm")
            journal.add_token(hash_token(token), role="guest", domain_uuid=dom.uuid, domain_name=dom.name)
            data = {"role": "guest", "domain": dom.name, "uuid": dom.uuid, "token": token}
    finally:
        journal.close()
    emit(args, data, lambda d: print(d["token"]))
    return EXIT_OK


def register(sub: Any) -> None:
    """Add `token issue`."""
    p = sub.add_parser("token", help="bearer tokens")
    tsub = p.add_subparsers(dest="token_command", metavar="ACTION")
    q = tsub.add_parser("issue", help="issue a token bound to one VM (or an operator token)")
    add_common_options(q, host=False)
    q.add_argument("--domain", help="VM name or UUID the token is bound to")
    q.add_argument("--operator", action="store_true", help="issue an operator token instead")
    q.add_argument("--state-dir", type=Path, help="override agent.state_dir")
    q.set_defaults(func=cmd_token_issue)
