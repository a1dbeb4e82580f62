"""Getting signed images to registries: push and promote (`push`, `push_plan` pure), Harbor (`harbor`),
and `imagebuild release`, every stage per variant (`pipeline`); the webhook's own image through those
stages (`admission_image`).

May import: core, oci, config, build, checks, trust.
"""
