"""Retention: what `imagebuild gc` keeps in the regions and the state repository (`live`, `state`: pure) and
in a matrix's layer cache and staging repository (`cache`: pure),
reading, deleting and the registry's own sweep (`gc`), and re-signing what gc keeps with a new key
(`rotation`).

May import: core, oci, config, trust, rollout.
"""
