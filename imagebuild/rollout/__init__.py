"""Moving channel tags region by region: the plan (pure), the state repository (`state`), the channel
lease (`lease`: a state repository tag, or a Kubernetes Lease), the reconciler, the gates between
waves, and quarantine marks.

May import: core, oci, config, checks, trust, kube.
"""
