"""Pipeline metrics: what `release`, `rollout`, `rescan` and `gc` tell Prometheus (`figures`: pure, from the
records those commands write; `sizes`: an image's compressed bytes from its manifests), and where it goes
(`export`: a node-exporter textfile or a Pushgateway).

May import: core, oci.
"""
