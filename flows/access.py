"""Document-level access: which groups may read a document, stored so every store filters on it.

A document carries the groups allowed to read it (none: everyone may). Its chunks carry them as
metadata under a reserved prefix, one boolean key per group (``ragline_acl.<group>: true``) or
``ragline_acl_public: true`` for a document without groups. Why booleans and not one array key:
Chroma 1.5.9 does filter arrays (``$contains``), but BM25's filter (``resources.filters.matches``)
and any store that compares scalars would need a new operator; an equality on a scalar key is
what every store already filters on.

A query's access (``Query.access``) is set by the server, never by a client: ``None`` reads
everything (an operator, the CLI), a set of groups reads public documents and those of its groups.
``restrict`` ANDs that clause with whatever the pipeline and the client asked, so a client's own
filter can only narrow it.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Iterable

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

ACL_PREFIX = "ragline_acl"  # every metadata key under it is the server's: refused in a client's filter
PUBLIC_KEY = f"{ACL_PREFIX}_public"
GROUP_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"
_GROUP = re.compile(GROUP_PATTERN)



def _group_name(name: str) -> str:
    return checked([name], "access")[0]


Group = Annotated[str, AfterValidator(_group_name)]
Access = frozenset[str] | None  # None: unrestricted; a set: public documents and those of these groups


def group_key(group: str) -> str:
    """The chunk metadata key that says ``group`` may read it."""
    return f"{ACL_PREFIX}.{group}"


def reserved(key: str) -> bool:
    """Whether a metadata key is the server's (access) and no client or document may set it."""
    return key.startswith(ACL_PREFIX)


def parse_groups(value: Any, where: str) -> tuple[str, ...]:
    """A document's groups from a metadata value: a list of names or one comma-separated string;
    ValueError naming ``where`` (the document and field) for anything else or a bad name."""
    if isinstance(value, str):
        names = [n.strip() for n in value.split(",") if n.strip()]
    elif isinstance(value, list) and all(isinstance(n, str) for n in value):
        names = [n.strip() for n in value]
    else:
        raise ValueError(f"{where}: access groups must be a list of names or a comma-separated string, "
                         f"got {type(value).__name__}")
    return checked(names, where)


def checked(names: Iterable[str], where: str) -> tuple[str, ...]:
    """Sorted, de-duplicated group names; ValueError naming ``where`` and the first bad name."""
    names = list(names)
    for name in names:
        if not _GROUP.match(name):
            raise ValueError(f"{where}: group name {name!r} must be 1-64 characters of letters, digits, '_', '.', "
                             f"':' or '-'")
    return tuple(sorted(set(names)))


def acl_metadata(groups: Iterable[str]) -> dict[str, bool]:
    """The metadata keys a chunk of a document readable by ``groups`` carries (none: public)."""
    groups = sorted(set(groups))
    return {group_key(g): True for g in groups} if groups else {PUBLIC_KEY: True}


def groups_of(metadata: dict[str, Any]) -> tuple[str, ...]:
    """The groups a chunk's metadata grants (empty: public)."""
    prefix = ACL_PREFIX + "."
    return tuple(sorted(k[len(prefix):] for k, v in metadata.items() if k.startswith(prefix) and v is True))


def without_acl(metadata: dict[str, Any]) -> dict[str, Any]:
    """Metadata without the reserved keys (a document's own metadata can never grant access)."""
    return {k: v for k, v in metadata.items() if not reserved(k)}


def clause(access: Access) -> dict[str, Any] | None:
    """The ``where`` clause a query with this access must satisfy (None: unrestricted)."""
    if access is None:
        return None
    allowed = [{PUBLIC_KEY: True}, *({group_key(g): True} for g in sorted(access))]
    return allowed[0] if len(allowed) == 1 else {"$or": allowed}


def restrict(where: dict[str, Any] | None, access: Access) -> dict[str, Any] | None:
    """``where`` ANDed with the access clause: what the client asked, within what it may read."""
    acl = clause(access)
    if acl is None:
        return where
    return {"$and": [where, acl]} if where else acl


def readable(metadata: dict[str, Any], access: Access) -> bool:
    """Whether a chunk with this metadata may be shown to a query with this access."""
    if access is None:
        return True
    return metadata.get(PUBLIC_KEY) is True or bool(access.intersection(groups_of(metadata)))


class AccessRule(BaseModel):
    """One rule of a root's ``access`` list: sources whose path below the root starts with ``prefix``
    are readable by ``groups`` (an empty list: by everyone). The first rule that matches decides."""

    model_config = ConfigDict(extra="forbid")

    prefix: str = Field("", description="path below the root, e.g. 'hr/' ('' matches every source)")
    groups: list[Group] = Field(..., description="groups allowed to read them ([]: everyone)")


def rule_groups(rules: list[AccessRule], path: str) -> tuple[str, ...] | None:
    """The groups of the first rule whose prefix ``path`` (below its root) starts with; None when none matches."""
    for rule in rules:
        if path.startswith(rule.prefix):
            return tuple(sorted(set(rule.groups)))
    return None
