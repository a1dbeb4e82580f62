"""Talking to OCI registries: image-reference grammar (`names`, `reference`), the HTTP client and its
per-host pool (`client`), credentials and tokens (`auth`), the one retry policy (`retry`), copy by
digest (`copy`) and where blobs were seen (`locations`).

May import: core.
"""
