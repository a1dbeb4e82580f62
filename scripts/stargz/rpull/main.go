// stargz-rpull: pull an image into a containerd for the stargz snapshotter, lazily. containerd 1.6's
// own `ctr pull` unpacks every layer itself; this client passes each layer's remote-snapshot labels
// (the reference, the layer digest, the image's other layers) to the snapshotter through the
// published handler wrapper, so the snapshotter mounts each eStargz layer from the registry instead
// and containerd fetches no layer blob. Prints the image's manifest digest.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/remotes/docker"
	dockerconfig "github.com/containerd/containerd/v2/core/remotes/docker/config"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/stargz-snapshotter/fs/source"
)

func main() {
	address := flag.String("address", "", "containerd's socket")
	namespace := flag.String("namespace", "default", "containerd namespace")
	snapshotter := flag.String("snapshotter", "stargz", "the proxy snapshotter's name in containerd's config")
	plainHTTP := flag.Bool("plain-http", false, "talk to the registry over plain HTTP")
	prefetch := flag.Int64("prefetch-size", 0, "bytes of each layer to prefetch where it has no landmark")
	flag.Parse()
	if *address == "" || flag.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: stargz-rpull --address SOCKET [--namespace NS] [--plain-http] REF")
		os.Exit(2)
	}
	ref := flag.Arg(0)
	client, err := containerd.New(*address)
	if err != nil {
		fail(err)
	}
	defer client.Close()
	ctx := namespaces.WithNamespace(context.Background(), *namespace)
	ctx, done, err := client.WithLease(ctx)
	if err != nil {
		fail(err)
	}
	defer func() { _ = done(ctx) }()

	hosts := dockerconfig.HostOptions{}
	if *plainHTTP {
		hosts.DefaultScheme = "http"
	}
	resolver := docker.NewResolver(docker.ResolverOptions{Hosts: dockerconfig.ConfigureHosts(ctx, hosts)})
	image, err := client.Pull(ctx, ref,
		containerd.WithResolver(resolver),
		containerd.WithPullUnpack,
		containerd.WithPullSnapshotter(*snapshotter),
		containerd.WithImageHandlerWrapper(source.AppendDefaultLabelsHandlerWrapper(ref, *prefetch)),
	)
	if err != nil {
		fail(err)
	}
	fmt.Println(image.Target().Digest)
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "stargz-rpull:", err)
	os.Exit(1)
}
