"""Retention: what `imagebuild gc` keeps in the regions and the state repository (`live`, `state`: pure),
and reading, deleting and the registry's own sweep (`gc`).

May import: core, oci, config, rollout.
"""
