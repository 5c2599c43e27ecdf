from engramd.cli.commands import main

main()
