from reports.cli import main

main()
