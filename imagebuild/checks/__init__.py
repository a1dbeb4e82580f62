"""What an image must pass before it is signed: smoke tests (`smoke` pure, `smoke_run` containers), the
Trivy scan and SBOM (`scan`), and the policy gate (`gate` pure, `gate_run`); the policy's exceptions as OpenVEX (`vex`, pure).

May import: core, oci, config, build.
"""
