// containerd-stargz-grpc for the tests and the benchmark: the stargz snapshotter (its service package)
// served over gRPC on a unix socket, for a containerd that names it as a proxy snapshotter plugin.
// Upstream's own daemon lives in a module the Go proxy does not serve, so this is the smallest main
// around the published package: no keychains (the registries here need no credentials), the
// in-memory metadata store, FUSE servers inside this process (SIGINT or SIGTERM unmounts them).
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/contrib/snapshotservice"
	"github.com/containerd/log"
	"github.com/containerd/stargz-snapshotter/service"
	"github.com/pelletier/go-toml/v2"
	"google.golang.org/grpc"
)

func main() {
	address := flag.String("address", "", "unix socket to serve the snapshots API on")
	root := flag.String("root", "", "the snapshotter's own directory (snapshots, FUSE mounts, cache)")
	configPath := flag.String("config", "", "TOML file of service.Config (optional)")
	level := flag.String("log-level", "info", "trace, debug, info, warn or error")
	flag.Parse()
	if *address == "" || *root == "" {
		fmt.Fprintln(os.Stderr, "usage: containerd-stargz-grpc --address SOCKET --root DIR [--config FILE]")
		os.Exit(2)
	}
	if err := log.SetLevel(*level); err != nil {
		fail(err)
	}
	log.SetFormat(log.JSONFormat)
	ctx := log.WithLogger(context.Background(), log.L)

	var config service.Config
	if *configPath != "" {
		raw, err := os.ReadFile(*configPath)
		if err != nil {
			fail(err)
		}
		if err := toml.Unmarshal(raw, &config); err != nil {
			fail(fmt.Errorf("%s: %w", *configPath, err))
		}
	}
	if err := service.Supported(*root); err != nil {
		fail(fmt.Errorf("overlayfs under %s: %w", *root, err))
	}
	snapshotter, err := service.NewStargzSnapshotterService(ctx, *root, &config)
	if err != nil {
		fail(err)
	}

	server := grpc.NewServer()
	snapshotsapi.RegisterSnapshotsServer(server, snapshotservice.FromSnapshotter(snapshotter))
	if err := os.MkdirAll(filepath.Dir(*address), 0o700); err != nil {
		fail(err)
	}
	_ = os.Remove(*address)
	listener, err := net.Listen("unix", *address)
	if err != nil {
		fail(err)
	}
	served := make(chan error, 1)
	go func() { served <- server.Serve(listener) }()
	log.G(ctx).WithField("address", *address).Info("serving the stargz snapshotter")

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM)
	select {
	case sig := <-signals:
		log.G(ctx).Infof("got %v: unmounting and exiting", sig)
	case err := <-served:
		log.G(ctx).WithError(err).Error("the gRPC server stopped")
	}
	server.Stop()
	if err := snapshotter.Close(); err != nil {
		log.G(ctx).WithError(err).Warn("closing the snapshotter")
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "containerd-stargz-grpc:", err)
	os.Exit(1)
}
