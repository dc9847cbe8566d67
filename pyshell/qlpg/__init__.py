"""qlpg: a PostgreSQL-native execution authority for Qinglong-style automation.

The authority lives in plpgsql SECURITY DEFINER functions in schema ``ql3`` (see ``sql/``);
this package is the thin shell: canonical digests, typed calls, migrations, the worker loop,
the CLI and the role/permission conformance suite.
"""

__version__ = "0.1.0"
