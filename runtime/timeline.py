"""`python -m runtime.timeline`: the public command; the code is runtime.observe.timeline."""

from runtime.observe.timeline import main

if __name__ == "__main__":
    main()
