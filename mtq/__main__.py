from mtq.cli.main import main

main()
