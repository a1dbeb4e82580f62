"""A small typed client for the Kubernetes API: the kubeconfig (`config`: server, CA, client certificate
or token), requests over verified TLS with oci.retry's one retry engine (`client`), and
coordination.k8s.io/v1 Lease documents, read back as untrusted input (`leases`, pure).

May import: core.
"""
