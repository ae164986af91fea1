from charly_arbiter.cli import main

main()
