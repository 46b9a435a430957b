"""L5 permission: tokens, authority, guard, roles, audit log."""
