"""From matrix to images: the plan (pure), Dockerfile rendering (pure), the build scheduler, the local
base image, publishing layers (layer store, fan-out), and the layer split (layersplit: standard library only, since
the build runs a copy of it too).

May import: core, oci, config.
"""
