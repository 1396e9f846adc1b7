"""``python -m ignite_mgpu`` works like ``ignite-mgpu`` (so ``torchrun ... -m ignite_mgpu train`` works)."""

from ignite_mgpu.cli.commands import main

if __name__ == "__main__":
    main()
