"""Moving channel tags region by region: the plan (pure), the state repository and its lease (`state`),
the reconciler, the gates between waves, and quarantine marks.

May import: core, oci, config, checks, trust.
"""
