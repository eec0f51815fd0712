"""Recognising and patching code as it is imported.

``patch`` (what a patch is, what happened to it), ``definitions`` and ``fingerprint`` (which code
is which), ``families`` (definitions copied between codebases), ``catalogue`` and ``selection`` (the
declared patches and which are wanted), ``versions`` (installed distributions), ``watcher`` (seeing
every execution of a module body, whoever found and loaded it), ``hooks`` (putting a fix in place and
taking it out), ``scan`` (copies of a family at any path), ``scripts`` (copies the running script
defines), ``ledger`` (the live state: known, wanted, installed, recorded) and ``activation``
(``apply``/``revert``/``applied``/``report``). Torch-free: this package is
imported at interpreter start under ``GRADPATCH=1``. It names fixes by dotted strings and imports
them only when a target is imported.
"""
