"""Run by scripts/test against a module built with `--no-default-features` (not collected
by pytest): a backend left out of the build is refused by name, with a ConfigError."""

import netagg

for backend in ("dpdk", "rdma"):
    try:
        netagg.Context(settings={"general.backend": backend})
    except netagg.ConfigError as error:
        assert f"backend = {backend} is not built into" in str(error), error
        assert f"the Cargo feature `{backend}`" in str(error), error
        print(f"without {backend}: {error}")
    else:
        raise SystemExit(f"backend = {backend} started in a module built without it")
