"""``python -m ascend_eplb.tools ...``: the ``ascend-eplb`` command (also under ``torchrun``)."""

from ascend_eplb.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
