"""
C{llmgw ctl user add|list|remove|passwd}: the people who may log in to
the admin API's page, kept in the control plane's certificates directory
(C{users.json}, as join tokens are), which the control plane reads again
when it changes: a removed user's sessions end at their next request. Run
where that directory is.

With C{--etcd} (an HA control plane) the users are etcd's
(L{llmgw.control.ha.sharedpeople}), which every member follows: a removed
user's sessions end on every member.

A password is read from C{--password-file} (its first line), else from the
terminal (asked twice), else from standard input's first line; never from
the command line, where other users of the host could read it.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from pathlib import Path
from typing import TextIO

from llmgw.control.core.users import USER_ROLES, USERS_FILE, UserError, UserFile, hash_password
from llmgw.control.ha.sharedpeople import UserStore
from llmgw.ctl.etcdkv import add_etcd_arguments, etcd_of, result_of
from llmgw.etcd import EtcdError

CERTS_ENV = "LLMGW_CERTS"


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("user", help="people who may log in to the page: add, list, remove, passwd")
    p.add_argument("--certs", default=os.environ.get(CERTS_ENV) or "certs", metavar="DIR",
                   help="the control plane's certificates directory (default $LLMGW_CERTS or certs)")
    certs = argparse.ArgumentParser(add_help=False)
    certs.add_argument("--certs", default=argparse.SUPPRESS, metavar="DIR",
                       help="the control plane's certificates directory")
    add_etcd_arguments(p)
    add_etcd_arguments(certs)
    password = argparse.ArgumentParser(add_help=False)
    password.add_argument("--password-file", metavar="FILE",
                          help="read the password from this file's first line (default: the terminal, "
                          "or standard input when it is not one)")
    s = p.add_subparsers(dest="user_command", required=True, metavar="COMMAND")
    a = s.add_parser("add", help="a new user", parents=[certs, password])
    a.add_argument("name", help="the user's name (letters, digits, - and .)")
    a.add_argument("--role", required=True, choices=USER_ROLES,
                   help="viewer reads; operator also changes the fleet; admin may do all an operator may")
    a.set_defaults(func=cmd_add)
    ls = s.add_parser("list", help="every user and role", parents=[certs])
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(func=cmd_list)
    r = s.add_parser("remove", help="a user who may log in no more (their sessions end)", parents=[certs])
    r.add_argument("name", help="the user's name")
    r.set_defaults(func=cmd_remove)
    pw = s.add_parser("passwd", help="a user's new password (their sessions end)", parents=[certs, password])
    pw.add_argument("name", help="the user's name")
    pw.set_defaults(func=cmd_passwd)


def _file(args: argparse.Namespace) -> UserFile:
    users = UserFile(Path(args.certs) / USERS_FILE)
    users.load()
    return users


def _shared(args: argparse.Namespace) -> UserStore | None:
    """The users in etcd with --etcd, else None (the certificates directory's file)."""
    found = etcd_of(args)
    return UserStore(found[0], found[1]) if found is not None else None


def read_password(args: argparse.Namespace, stdin: TextIO | None = None) -> str:
    """
    The password C{args} asks for: from C{--password-file}, the terminal
    (twice, they must match) or standard input.

    @raise UserError: unreadable, or the two typed differ.
    """
    if getattr(args, "password_file", None):
        try:
            text = Path(args.password_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read the password file: {e}") from None
        return text.splitlines()[0] if text else ""
    stdin = stdin if stdin is not None else sys.stdin
    if stdin.isatty():
        first = getpass.getpass("password: ")
        if getpass.getpass("again: ") != first:
            raise UserError("the two passwords differ")
        return first
    return stdin.readline().rstrip("\r\n")


def cmd_add(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
            stdin: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    shared = _shared(args)
    try:
        if shared is not None:
            user = hash_password(args.name, args.role, read_password(args, stdin))
            result_of(shared.add(user))
        else:
            users = _file(args)
            if users.book.get(args.name) is not None:
                raise UserError(f"user {args.name!r} exists (`llmgw ctl user passwd` changes a password)")
            users.book.add(hash_password(args.name, args.role, read_password(args, stdin)))
            users.save()
    except UserError as e:
        err.write(f"llmgw ctl user add: {e}\n")
        return 2
    except EtcdError as e:
        err.write(f"llmgw ctl user add: {e}\n")
        return 1
    out.write(f"user {args.name} added with role {args.role}\n")
    return 0


def cmd_list(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    import json

    out, err = out or sys.stdout, err or sys.stderr
    shared = _shared(args)
    try:
        rows = result_of(shared.listing()) if shared is not None else _file(args).book.listing()
    except EtcdError as e:
        err.write(f"llmgw ctl user list: {e}\n")
        return 1
    if getattr(args, "json", False):
        out.write(json.dumps(rows, indent=2) + "\n")
        return 0
    out.write(f"{'NAME':<32} ROLE\n")
    for r in rows:
        out.write(f"{r['name']:<32} {r['role']}\n")
    return 0


def cmd_remove(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    shared = _shared(args)
    try:
        if shared is not None:
            result_of(shared.remove(args.name))
        else:
            users = _file(args)
            users.book.remove(args.name)
            users.save()
    except (KeyError, UserError):
        err.write(f"llmgw ctl user remove: no user {args.name!r} (`llmgw ctl user list`)\n")
        return 1
    except EtcdError as e:
        err.write(f"llmgw ctl user remove: {e}\n")
        return 1
    out.write(f"user {args.name} removed\n")
    return 0


def cmd_passwd(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
               stdin: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    shared = _shared(args)
    try:
        if shared is not None:
            user = result_of(shared.get(args.name))
        else:
            users = _file(args)
            user = users.book.get(args.name)
    except EtcdError as e:
        err.write(f"llmgw ctl user passwd: {e}\n")
        return 1
    except UserError:
        user = None
    if user is None:
        err.write(f"llmgw ctl user passwd: no user {args.name!r} (`llmgw ctl user list`)\n")
        return 1
    try:
        new = hash_password(user.name, user.role, read_password(args, stdin))
        if shared is not None:
            result_of(shared.replace(new))
        else:
            users.book.replace(new)
            users.save()
    except UserError as e:
        err.write(f"llmgw ctl user passwd: {e}\n")
        return 2
    except KeyError:
        err.write(f"llmgw ctl user passwd: no user {args.name!r} (`llmgw ctl user list`)\n")
        return 1
    except EtcdError as e:
        err.write(f"llmgw ctl user passwd: {e}\n")
        return 1
    out.write(f"password of {args.name} changed\n")
    return 0
