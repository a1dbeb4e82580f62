from imagebuild.cli import main

main()
