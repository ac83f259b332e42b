from onnxopt.cli import main
import sys
sys.exit(main())
