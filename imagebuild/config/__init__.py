"""Files a user hands us, each parsed and checked before anything acts on it: the matrix and the support
table, `--only` selection, the trust file, and the release file (regions, waves, gates).

May import: core, oci.
"""
