from gpuledger.cli import main

main()
