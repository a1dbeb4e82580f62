"""From matrix to images: the plan (pure), Dockerfile rendering (pure), the build scheduler, the local
base image, and publishing layers (layer store, fan-out).

May import: core, oci, config.
"""
